"""A model's Jinja chat template: found in its folder (or given by `--chat-template`),
compiled in a sandbox once, and rendered for a request.

HF's template conventions are supported: `{% generation %}` blocks (rendered unchanged),
`raise_exception`, `strftime_now`, and a `tojson` that writes plain JSON. The template is
data, as are a request's `chat_template` and `chat_template_kwargs`: whatever they fail
with is the request's 400, never the server's 500.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InvalidRequest, ModelLoadError

# Template variables that render_chat sets itself: `chat_template_kwargs` may not replace
# them (the tools must be the ones the answer is parsed against).
RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt")


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ModelLoadError(f"{path.name} is not valid JSON") from exc
    return data if isinstance(data, dict) else {}


class ChatTemplateError(ValueError):
    """A server-wide chat template (`--chat-template`) that cannot be used."""


def chat_template_from_setting(value: str) -> str:
    """`--chat-template`, read as vLLM reads it: a file holding a Jinja chat template,
    or, when no such file opens and the value looks like a template (a `{` or a newline),
    the template itself, its backslash escapes (`\\n` typed in a shell) decoded. Its
    syntax is checked here, at start-up."""
    path = Path(value)
    if path.is_file():
        source = path.read_text(encoding="utf-8")
    elif "{" in value or "\n" in value:
        # unicode_escape reads Latin-1 bytes: other characters go in as \u escapes
        source = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    else:
        raise ChatTemplateError(f"chat_template: no file {value}")
    if (error := syntax_error(source)) is not None:
        raise ChatTemplateError(f"chat_template has {error}")
    return source


def syntax_error(source: str) -> str | None:
    """The template's Jinja syntax error ("a syntax error on line 3: ..."), or None."""
    try:
        compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        return f"a syntax error on line {exc.lineno}: {exc.message}"
    return None


def find_chat_template(
    folder: Path, tokenizer_config: dict, *, name: str = "default"
) -> str | None:
    """The model folder's chat template. Where the checkpoint names several
    ([{"name": "default", "template": ...}, {"name": "tool_use", ...}]), the one of `name`
    (transformers renders a chat with tools through "tool_use" where there is one)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8") if name == "default" else None
    template = read_json(folder / "chat_template.json").get("chat_template")
    if template is None:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {
            item.get("name"): item.get("template") for item in template if isinstance(item, dict)
        }
        template = named.get(name)
    elif name != "default":
        return None
    return template if isinstance(template, str) else None


def template_for_request(source: str, template_kwargs: dict[str, Any]) -> jinja2.Template:
    """The compiled template, once `template_kwargs` (`chat_template_kwargs`) are known to
    hide none of its variables and functions; a syntax error is the request's 400."""
    try:
        template = compile_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequest(
            f"the chat template has a syntax error: {exc.message}", param="chat_template"
        ) from exc
    # `self` is Template.render's own first parameter
    taken = sorted(set(template_kwargs) & {*RESERVED_TEMPLATE_VARIABLES, "self"})
    if taken:
        raise InvalidRequest(
            f"chat_template_kwargs cannot set {', '.join(taken)}: the server sets them",
            param="chat_template_kwargs",
        )
    # The template's own functions (namespace, range, raise_exception, ...): a variable
    # of the same name would hide one, and the template would fail calling it.
    shadowed = sorted(set(template_kwargs) & set(template.environment.globals))
    if shadowed:
        raise InvalidRequest(
            f"chat_template_kwargs cannot set {', '.join(shadowed)}: the chat template's "
            "own functions have those names",
            param="chat_template_kwargs",
        )
    return template


def render_template(
    template: jinja2.Template, context: dict[str, Any], *, request_template: bool
) -> str:
    """`template` rendered with `context`; whatever it fails with is a 400, blamed on the
    request's own template (`request_template`) or else on its messages."""
    try:
        return template.render(**context)
    except jinja2.TemplateError as exc:
        # raise_exception() in templates (e.g. "roles must alternate") lands here.
        raise InvalidRequest(
            f"the chat template rejected the messages: {exc.message}", param="messages"
        ) from exc
    except InvalidRequest:
        raise
    except Exception as exc:  # noqa: BLE001 - the template is data, as are its inputs
        # A template (the request's own, or the model's on odd inputs such as
        # chat_template_kwargs of another type than it expects) that fails in Python.
        raise InvalidRequest(
            f"the chat template failed on this request: {type(exc).__name__}: {exc}",
            param="chat_template" if request_template else "messages",
        ) from exc


# ---------------------------------------------------------------------- jinja environment


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) and
    render its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)


@lru_cache(maxsize=32)
def takes_content_parts(source: str) -> bool:
    """Whether a chat template reads a message's content as a list of parts (it loops over
    `message.content`, as vision templates do) rather than as one string (Qwen3's, Llama
    3's: a list reached the model as its Python repr, or failed the template). vLLM tells
    the two apart the same way, and joins the text parts for the second kind. The loop
    may be over a variable set to the content, or over a macro's parameter that a call
    passes the content to (Qwen3-VL's `render_content(message.content)`)."""
    environment = compile_template(source).environment
    try:
        tree = environment.parse(source)
    except jinja2.TemplateSyntaxError:
        return True  # left as it is: rendering reports the error
    content_names = {
        assign.target.name
        for assign in tree.find_all(jinja2.nodes.Assign)
        if isinstance(assign.target, jinja2.nodes.Name) and _reads_content(assign.node)
    }
    for macro in tree.find_all(jinja2.nodes.Macro):
        for call in tree.find_all(jinja2.nodes.Call):
            if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
                passed = zip(macro.args, call.args, strict=False)  # defaults fill the rest
                content_names.update(param.name for param, arg in passed if _reads_content(arg))
    return any(
        _reads_content(loop.iter)
        or (isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name in content_names)
        for loop in tree.find_all(jinja2.nodes.For)
    )


def _reads_content(node: jinja2.nodes.Node) -> bool:
    """Whether an expression is `x.content` / `x["content"]`, filtered or not (a loop
    over `message.content.split(...)` takes a string)."""
    while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return (isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == "content")  # fmt: skip
