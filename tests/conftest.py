import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sandbox import executor  # noqa: E402
import model_loading  # noqa: E402
import features.sampler_options  # noqa: E402,F401 (the sampler's features, as train.py's feature list imports them)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Config + byte-level tokenizer, no weights; a larger init range makes greedy decoding non-trivial."""
    return model_loading.write_tiny_model(str(tmp_path_factory.mktemp("tiny")), initializer_range=0.2)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    return model_loading.load_tokenizer(tiny_dir)


@pytest.fixture
def model(tiny_dir):
    torch.manual_seed(0)
    m = model_loading.load_model(tiny_dir, {"dtype": "float32", "attn_implementation": "sdpa"}, "cpu", seed=0)
    return m.eval()


@pytest.fixture
def traced_layers(monkeypatch):
    """transformer's compiled layer through torch.compile with a backend that records each graph it is
    given and runs it as traced (no code generation: fast, and exact): a test then sees that the layer
    traces whole (fullgraph), how many graphs it took, and that it computes what the eager layer does."""
    from layers import transformer
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    monkeypatch.setitem(transformer._COMPILED, "layer", transformer.compile_layer(backend))
    yield graphs
    torch._dynamo.reset()


def finished(proc, result):
    """Whether a 2-process torchrun worker (subprocess.run's `proc`) did its work: it exited 0, or gloo aborted
    while the group was torn down ("terminate called without an active exception", about one launch in fifty
    on 2 CPU cores) after rank 0 had written `result`, its last act once every collective was done."""
    return proc.returncode == 0 or ("terminate called without an active exception" in proc.stdout + proc.stderr
                                    and os.path.exists(result))


@pytest.fixture(scope="module")
def strict():
    """The strict sandbox, or the test skipped saying why the kernel refuses it here."""
    try:
        executor.check("strict")
    except executor.ExecutorUnavailable as e:
        pytest.skip(str(e))
