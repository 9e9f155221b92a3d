"""scripts/constraints-vision.txt (the vision environment's pins, scripts/vision_venv.sh) is scripts/constraints.txt with
torch and torchvision changed: the same version of every other package, so a test in the vision environment tests the
libraries the main suite tests. When scripts/lock.sh refreshes constraints.txt, this says which lines to carry over."""

from __future__ import annotations

from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
def pins(name: str) -> dict[str, str]:
    out = {}
    for line in (SCRIPTS / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pkg, _, version = line.partition("==")
            out[pkg.lower()] = version
    return out


def vision_only(pkg: str) -> bool:
    """Only in the vision environment: torch's CUDA build and what it requires, and SmolVLM's processor's num2words."""
    return pkg in ("torch", "torchvision", "triton", "num2words", "docopt") or pkg.startswith(("cuda-", "nvidia-")) and pkg != "nvidia-ml-py"


def test_the_vision_pins_are_the_main_pins_with_torch_and_torchvision_changed():
    main, vision = pins("constraints.txt"), pins("constraints-vision.txt")
    assert vision["torch"] == "2.14.1" and vision["torchvision"] == "0.29.1" and "torch" not in main
    shared = {k: v for k, v in vision.items() if not vision_only(k)}
    assert {k: v for k, v in main.items() if k != "triton"} == shared, "scripts/constraints-vision.txt differs from scripts/constraints.txt " \
        "beyond torch/torchvision and what they require: carry the new lines over"


def test_the_script_installs_under_the_vision_pins_and_ci_makes_it_beside_the_main_environment():
    script = (SCRIPTS / "vision_venv.sh").read_text()
    assert "constraints-vision.txt" in script and "TRAINPIPE_VISION_VENV" in script and ".pins" in script
    assert "scripts/vision_venv.sh" in (SCRIPTS.parent / ".ci" / "run").read_text()
