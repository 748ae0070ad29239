"""The core stays clean: one default step, traced, enters no feature file (bench/reader.py's FEATURES), and the
trace would see one if a feature's code ran inside the step."""

import contextlib
import io
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench import reader  # noqa: E402


def traced_step(argv=()):
    with contextlib.redirect_stdout(io.StringIO()):
        return reader.measure(reader.trace_default_step(step=2, argv=argv))


def test_a_default_step_enters_no_feature_file():
    path = traced_step()
    assert path["reader_feature_files"] == [], path["reader_feature_files"]
    assert "train.py" in path["reader_file_lines"] and "sampling.py" in path["reader_file_lines"]


def test_the_trace_sees_a_feature_that_runs_inside_the_step(monkeypatch):
    """A step whose update calls into a feature file (as a feature's branch in the core would) is caught."""
    import train
    from features import streaming
    update = train.update

    def leaky(run, batch, advantages, step):
        streaming.scores_on_land(run)  # a feature's code, run from the core's update
        return update(run, batch, advantages, step)
    monkeypatch.setattr(train, "update", leaky)
    assert traced_step()["reader_feature_files"] == ["features/streaming.py"]


def test_a_feature_run_enters_its_own_file():
    """The trace is of the step that ran: with --dynamic_sampling, its file is on the path."""
    path = traced_step(["--dynamic_sampling"])
    assert "features/dynamic_sampling.py" in path["reader_feature_files"]
