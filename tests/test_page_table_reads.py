"""A page table is read, and copied, only as far as a call reads it: a table sized for the longest context a model
allows (MaxP far past the pages of positions [0, start_pos + seqlen)) gives what a table of just those columns gives,
and costs no more memory. Both ops' CPU kernels through the C entry points, in a child whose peak memory is
measured; the CUDA kernels' device copies are held to the same in test_attention_host_runner.py."""

import json
import textwrap

import pytest

from processes import run_script

SCRIPT = """
    import json, resource
    import numpy as np
    from kvcache_op.capi import c_api
    from kvcache_op.validation.cases import Seq, build
    from kvcache_op.validation.mhca_cases import build_cache_attention

    WIDE_COLUMNS = 2 ** 26  # two rows of 512 MiB of address space each: only their first page is ever touched

    def peak_bytes():  # the process's peak resident memory so far (Linux: KiB)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def widened(inputs):
        table = inputs["cachestarts"]
        wide = np.zeros((table.shape[0], WIDE_COLUMNS), np.int64)  # untouched pages take no memory
        wide[:, :table.shape[1]] = table
        return dict(inputs, cachestarts=wide)

    def fresh(inputs):
        return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}

    seqs = [Seq(30, 2), Seq(0, 5), Seq(7, 0)]
    if OP == "MultiHeadCacheAttention":
        case = build_cache_attention("wide-table", seqs, group=2, decoding=0, cache_mode=1, page_size=4,
                                     cache_layout=3, quant_bit=8, quant_group=4)
        run = c_api.multi_head_cache_attention
    else:
        case, run = build("wide-table", seqs, cache_mode=1, page_size=4, cache_layout=1), c_api.key_value_cache
    narrow_in, wide_in = fresh(case.inputs), widened(fresh(case.inputs))
    outputs = []
    for inputs in (narrow_in, wide_in):
        start = peak_bytes()
        out = run(**inputs, **case.attributes)
        grew = peak_bytes() - start  # the wide call's, as it runs second
        outputs.append(b"".join(a.tobytes() for a in (out if isinstance(out, tuple) else (out,))))
    same = outputs[0] == outputs[1] and narrow_in["cache"].tobytes() == wide_in["cache"].tobytes()
    print(json.dumps({"grew": grew, "same": same}))
"""


@pytest.mark.parametrize("op", ["MultiHeadCacheAttention", "KeyValueCache"])
def test_a_page_table_wider_than_the_call_reads_is_neither_copied_nor_changes_the_result(op):
    """Each op in a child of its own: a peak once reached hides any later one below it."""
    done = run_script(f"OP = {op!r}\n" + textwrap.dedent(SCRIPT), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["same"], f"{op}: the wide table's output or cache differs from the narrow table's"
    # a copy of the table would take 2 x 512 MiB; the columns read are a few hundred bytes
    assert seen["grew"] < 64 * 2 ** 20, f"{op}: peak memory grew by {seen['grew'] / 2 ** 20:.0f} MiB in the call"
