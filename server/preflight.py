"""The model folder, checked before the engine loads the weights.

Loading takes minutes on a GPU, and the API process reads the folder's tokenizer, chat
template and image processor only once the engine is ready: a broken file there made a
server load its weights and then fail with tracebacks (uvicorn's exit 3), a missing
preprocessor_config.json refused every image, and a chat template with a syntax error
failed every chat with a 400 that blamed the client. `check_model_folder` reads all of it
first, as the server will, and `tessera serve` turns what it finds into one line and
exit 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import ModelLoadError
from engine.model_config import ModelConfig, check_max_model_len
from engine.multimodal.chat_template import syntax_error
from engine.multimodal.image_processor import ImageProcessorConfig
from engine.multimodal.prompt import PromptProcessor

if TYPE_CHECKING:
    from server.settings import ServerSettings


def check_model_folder(settings: ServerSettings) -> None:
    """Raises ModelLoadError naming what in the model folder the server cannot use."""
    folder = Path(settings.engine.model).expanduser()
    model_config = ModelConfig.from_model_dir(folder)  # a missing folder is named here
    check_max_model_len(settings.engine.max_model_len, model_config)
    model_config.shard(settings.engine.tensor_parallel_size)  # a size it cannot split into
    template_setting = settings.chat_template_source()
    processor = PromptProcessor.from_model_dir(folder, template_setting)
    if template_setting is None:  # a --chat-template was checked as the settings were read
        for template in (processor.chat_template, processor.tool_chat_template):
            if template is not None and (error := syntax_error(template)) is not None:
                raise ModelLoadError(f"the model folder's chat template has {error}")
    if model_config.vision is not None:
        ImageProcessorConfig.from_model_dir(folder)  # the server preprocesses images with it
