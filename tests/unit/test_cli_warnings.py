"""What `tessera serve` says at start-up about what its settings leave open to clients."""

from __future__ import annotations

from engine.config import EngineConfig
from server.cli import open_doors
from server.settings import ServerSettings


def settings(**fields) -> ServerSettings:
    engine = fields.pop("engine", {})
    fields.setdefault("host", "127.0.0.1")
    return ServerSettings(engine=EngineConfig(model="m", **engine), **fields)


def test_a_server_open_to_any_bucket_says_so():
    """With feature inputs on and no bucket or prefix list, a client could read any object
    the server's credentials can, and learn from the errors what exists (fuzz61): nothing
    said so."""
    (warning,) = open_doors(settings(enable_feature_inputs=True))
    assert "any S3 bucket" in warning and "--allowed-feature-buckets" in warning
    assert open_doors(settings(enable_feature_inputs=True, allowed_feature_buckets="feat")) == []
    scoped = settings(enable_feature_inputs=True,
                      engine={"allowed_feature_url_prefixes": "s3://feat/"})  # fmt: skip
    assert open_doors(scoped) == [] and open_doors(settings()) == []


def test_a_server_on_every_interface_without_a_key_says_so():
    (warning,) = open_doors(settings(host="0.0.0.0", port=8123))
    assert "without an API key" in warning and "8123" in warning
    assert open_doors(settings(host="0.0.0.0", api_key="k")) == []
