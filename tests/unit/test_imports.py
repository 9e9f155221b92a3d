"""Every module imports with the core dependencies installed."""

import importlib
import pkgutil

import trainpipe


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(trainpipe.__path__, "trainpipe.")]
    assert "trainpipe.cli" in names and "trainpipe.pipeline.run" in names
    for name in names:
        importlib.import_module(name)


def test_events_reject_unknown_names(tmp_path):
    import pytest

    from trainpipe.events import EventLog, read_events

    log = EventLog(tmp_path / "events.jsonl")
    log.emit("training_started", step=0, max_steps=10)
    with pytest.raises(ValueError):
        log.emit("made_up_event")
    (ev,) = read_events(tmp_path / "events.jsonl")
    assert ev["event"] == "training_started" and ev["step"] == 0 and ev["max_steps"] == 10 and "time" in ev
