"""kvcache_op.torch.export_onnx's file when its weights go to a data file (the external-data size lowered to 0 so a
small module's do): the data file beside it as readable as the file and replaced by a later save, the returned
model left whole by the save, and both running in ONNX Runtime as the eager module computes, with either exporter."""

import os
import stat

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch front-end needs the 'torch' extra: pip install '.[torch]'")

import kvcache_op.torch as kt  # noqa: E402
from ort_helpers import copies  # noqa: E402
from torch_convert import to_numpy, torch_inputs  # noqa: E402

from kvcache_op.ort_ops import large_models, make_session, run_model  # noqa: E402
from kvcache_op.spec import schema  # noqa: E402
from kvcache_op.validation.cases import Seq, build  # noqa: E402

NAMES = list(schema.INPUTS)[:9]  # no scale: float32 cache


class WeightedStore(torch.nn.Module):
    """KeyValueCache, then its key output times a 16 x 16 weight (1 KiB: an initializer of its own)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(-1, 1, 256).reshape(16, 16), requires_grad=False)

    def forward(self, current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos, max_seqlen, max_kvlen,
                cache):
        key, value = kt.key_value_cache(current_key, current_value, seqstarts, kvstarts, cachestarts, start_pos,
                                        max_seqlen, max_kvlen, cache, None, page_size=4)
        return key @ self.weight, value


def _case():
    return build("files", [Seq(0, 3), Seq(2, 1)], num_layer=1, heads=2, head_dim=16, quant_bit=0, quant_group=4,
                 num_repeat=1, cache_mode=0, cache_layout=0, page_size=4, t1="float32", t3="float32", max_t=64,
                 max_pages=4)


def _feeds(case):
    return {k: v for k, v in copies(case.inputs).items() if k in NAMES}


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_weights_in_a_data_file_and_the_returned_model_whole(dynamo, tmp_path, monkeypatch):
    monkeypatch.setattr(large_models, "EXTERNAL_DATA_BYTES", 0)
    case, module = _case(), WeightedStore().eval()
    tensors = torch_inputs(copies(case.inputs))
    expected = [to_numpy(o, np.empty(tuple(o.shape), np.float32)) for o in module(**{n: tensors[n] for n in NAMES})]
    args = tuple(torch_inputs(copies(case.inputs))[n] for n in NAMES)
    path = tmp_path / "kv.onnx"
    kwargs = {} if dynamo else dict(input_names=NAMES)
    for _ in range(2):  # the second save over the first replaces its data file
        model = kt.export_onnx(module, args, path, dynamo=dynamo, **kwargs)
        data = [p for p in tmp_path.iterdir() if p.name.endswith(".data")]
        assert len(data) == 1 and data[0].name.startswith("kv.onnx.")
        assert stat.S_IMODE(data[0].stat().st_mode) == stat.S_IMODE(path.stat().st_mode)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["kv.onnx", data[0].name])
    assert not any(t.external_data for t in model.graph.initializer)  # the save left the returned model whole
    from_memory = run_model(model, _feeds(case))
    session = make_session(str(path))
    from_file = run_model(None, _feeds(case), session=session)
    for got in (from_memory, from_file):
        for out, want in zip(got, expected):
            np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    os.remove(path)
