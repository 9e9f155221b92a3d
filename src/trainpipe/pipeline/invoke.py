"""`python -m trainpipe.pipeline.invoke CALL.json`: one function step of `pipeline.steps` (custom.py), in its own process.

CALL.json holds `function` (`file.py:name`, relative to `base`), `inputs` and `outputs` (name -> path) and `params`;
the function is called as `name(inputs={...: Path}, outputs={...: Path}, params={...})`. User code is imported here
only: by the process that runs the step.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path


def main(call_file: str) -> int:
    call = json.loads(Path(call_file).read_text(encoding="utf-8"))
    rel, name = call["function"].split(":")
    file = (Path(call["base"]) / rel).resolve()
    sys.path.insert(0, str(file.parent))
    spec = importlib.util.spec_from_file_location(f"trainpipe_step_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name)
    fn(inputs={k: Path(v) for k, v in call["inputs"].items()}, outputs={k: Path(v) for k, v in call["outputs"].items()}, params=call["params"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
