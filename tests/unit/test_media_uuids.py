"""The registry of media uuids: bounded by --max-remembered-media-uuids, least recently
used forgotten first, a uuid known only to its cache salt."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import MediaError
from engine.protocol import Modality
from server.chat import UuidRegistry
from server.settings import ServerSettings


class _Image:
    grid_thw = (1, 4, 4)
    num_tokens = 4
    second_per_grid_t = 1.0
    frame_seconds = ()


def _known(registry: UuidRegistry, uuid: str, salt: str | None = None) -> bool:
    try:
        registry.lookup(uuid, Modality.IMAGE, salt, param="p")
    except MediaError:
        return False
    return True


def test_a_uuid_named_since_it_was_sent_outlives_newer_ones():
    """Naming a uuid counts as using it: before, one sent once and named by every request
    after was the first forgotten."""
    registry = UuidRegistry(capacity=2)
    registry.remember("a", Modality.IMAGE, None, _Image())
    registry.remember("b", Modality.IMAGE, None, _Image())
    assert _known(registry, "a")
    registry.remember("c", Modality.IMAGE, None, _Image())
    assert [_known(registry, uuid) for uuid in "abc"] == [True, False, True]


def test_a_uuid_is_known_only_to_its_salt():
    registry = UuidRegistry(capacity=4)
    registry.remember("a", Modality.IMAGE, "tenant-1", _Image())
    assert _known(registry, "a", "tenant-1") and not _known(registry, "a", "tenant-2")
    assert not _known(registry, "a")


def test_the_capacity_is_a_setting():
    field = ServerSettings.__dataclass_fields__["max_remembered_media_uuids"]
    assert field.default == UuidRegistry().capacity
    with pytest.raises(ValueError, match="max_remembered_media_uuids"):
        ServerSettings(engine=EngineConfig(model="m"), max_remembered_media_uuids=0)


def test_naming_a_uuid_refreshes_it_in_the_other_api_processes():
    """Only new uuids were shared: the process a uuid-only part reached kept it, the others
    forgot it first (fuzz51)."""
    here, there = UuidRegistry(capacity=2), UuidRegistry(capacity=2)
    here.share_with(there.learn)
    here.remember("a", Modality.IMAGE, None, _Image())
    here.remember("b", Modality.IMAGE, None, _Image())
    here.lookup("a", Modality.IMAGE, None, param="p")
    here.remember("c", Modality.IMAGE, None, _Image())
    assert [_known(there, uuid) for uuid in "abc"] == [True, False, True]
