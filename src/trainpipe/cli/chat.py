"""`trainpipe chat RUN_OR_MODEL`: talk to a trained text model (the export, with its chat template), interactively or once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from trainpipe.cli._app import app


@app.command()
def chat(
    run_or_model: Annotated[Path, typer.Argument(help="A finished run directory (its exported `model/`) or a model folder.", show_default=False)],
    prompt: Annotated[Optional[str], typer.Option("--prompt", help="Ask this once, print the reply and exit (no interactive session).")] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="A system message before the conversation.")] = None,
    tools: Annotated[Optional[Path], typer.Option("--tools", help="A JSON file of tool schemas given to the chat template as `tools=` (as training did).")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="The longest reply, in tokens.")] = 256,
) -> None:
    """Chat with a trained model: the exported folder loaded as a user would (transformers), each turn rendered with
    its chat template and answered greedily. `--prompt TEXT` asks once; without it, type a message per line (an empty
    line or Ctrl-D ends the session; `/reset` starts over)."""
    from trainpipe.errors import ConfigError
    from trainpipe.train import textgen

    folder = textgen.model_dir(run_or_model)
    if textgen.is_classifier(folder):
        raise ConfigError(f"`{folder}` is a classifier (it predicts a class, it does not reply); use `trainpipe predict {run_or_model} --data FILE.jsonl`.")
    schemas = None
    if tools is not None:
        try:
            schemas = json.loads(tools.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"`--tools {tools}` is not a readable JSON file of tool schemas ({exc}); give a JSON list of function schemas.") from None
    model, tok, stops = textgen.load(folder)
    start = [{"role": "system", "content": system}] if system else []
    if prompt is not None:
        typer.echo(textgen.reply(model, tok, stops, start + [{"role": "user", "content": prompt}], tools=schemas, max_new_tokens=max_new_tokens))
        return
    history = list(start)
    typer.echo(f"chatting with {folder} (an empty line or Ctrl-D ends; /reset starts over)")
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            history = list(start)
            continue
        history.append({"role": "user", "content": line})
        answer = textgen.reply(model, tok, stops, history, tools=schemas, max_new_tokens=max_new_tokens)
        history.append({"role": "assistant", "content": answer})
        typer.echo(f"model> {answer}")
