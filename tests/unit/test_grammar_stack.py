"""llguidance builds grammars recursively: a long chain of rules or $refs overflowed a
thread's stack and killed the process (fuzz118: a 67 KB Lark chain of 3000 rules, a 228 KB
schema of 3000 chained $refs). Builds run on a thread with a stack made for the largest
spec the server's limits let through (engine/structured_output.py `on_grammar_stack`).
Each case runs in a child process, so a crash fails the test instead of ending pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from server.field_limits import DEFAULT_FIELD_LIMITS

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMA_CHARS = DEFAULT_FIELD_LIMITS.max_structured_output_schema_chars
GRAMMAR_CHARS = DEFAULT_FIELD_LIMITS.max_structured_output_grammar_chars

# Each builds `spec`, the longest chain of its kind within the server's default limits.
CHAINS = {
    "lark rules": f"""
        rules, n = ["start: r0"], 0
        while sum(len(rule) + 1 for rule in rules) < {GRAMMAR_CHARS} - 40:
            rules.append(f'r{{n}}: "x" r{{n + 1}} | "y"'); n += 1
        spec = StructuredOutput(grammar="\\n".join([*rules, f'r{{n}}: "z"']))
        """,
    "$refs through properties": f"""
        defs, n = {{}}, 0
        while len(json.dumps(defs)) < {SCHEMA_CHARS} - 200 * 80:
            for _ in range(200):
                defs[f"d{{n}}"] = {{"type": "object", "properties": {{"x": {{"$ref": f"#/$defs/d{{n + 1}}"}}}}}}
                n += 1
        defs[f"d{{n}}"] = {{"type": "string"}}
        spec = StructuredOutput(json=json.dumps({{"$ref": "#/$defs/d0", "$defs": defs}}))
        """,
    "$refs through anyOf": f"""
        defs, n = {{}}, 0
        while len(json.dumps(defs)) < {SCHEMA_CHARS} - 200 * 80:
            for _ in range(200):
                defs[str(n)] = {{"anyOf": [{{"$ref": f"#/$defs/{{n + 1}}"}}, {{"type": "null"}}]}}
                n += 1
        defs[str(n)] = {{"type": "string"}}
        spec = StructuredOutput(json=json.dumps({{"$ref": "#/$defs/0", "$defs": defs}}))
        """,
}


@pytest.mark.parametrize("kind", sorted(CHAINS))
def test_the_longest_chains_the_limits_allow_build_without_a_crash(kind, tmp_path):
    from engine.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m")
    script = (
        textwrap.dedent("""
        import json
        from engine.protocol import StructuredOutput
        from engine.structured_output import GrammarCompiler, grammar_error
        """)
        + textwrap.dedent(CHAINS[kind])
        + textwrap.dedent(f"""
        limit = {SCHEMA_CHARS} if spec.json else {GRAMMAR_CHARS}
        assert limit * 0.95 < len(spec.grammar or spec.json) <= limit
        error = grammar_error(spec)  # the server's check
        compiler = GrammarCompiler({str(model_dir / "tokenizer.json")!r}, 2048, (1538,))
        try:  # the engine's build
            compiler.matcher(spec)
        except Exception as exc:
            error = error or str(exc)
        print("built:", error)
        """)
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "built:" in done.stdout


def test_no_large_stack_fails_the_build_with_a_reason_and_never_runs_it(monkeypatch):
    """Under a tight `ulimit -v` the large-stack thread cannot start: every grammar check
    was an unexplained 500 (fuzz121), and building on the caller's stack instead let a chain
    within the limits crash the engine (fuzz122). The build fails, saying why."""
    import threading

    from engine.errors import TesseraError
    from engine.structured_output import on_grammar_stack

    def no_room(self):
        raise RuntimeError("can't start new thread")

    built = []
    monkeypatch.setattr(threading.Thread, "start", no_room)
    with pytest.raises(TesseraError, match="ulimit -v") as refused:
        on_grammar_stack(lambda: built.append(1))
    assert refused.value.code == "grammar_stack_unavailable" and not built
    monkeypatch.undo()
    assert on_grammar_stack(threading.get_ident) != threading.get_ident()  # its own thread
    assert threading.stack_size() == 0  # the process's default put back
