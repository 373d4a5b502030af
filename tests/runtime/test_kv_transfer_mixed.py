"""FP8-block prefill + INT4 decode (the reference deployment's split): the prefill worker on the FP8-block
source, the decode worker on kvq's `w4a16-experts` output of it (experts INT4, attention and the dense
first layer kept FP8-block). With two layers the weights that shape the prompt's K/V agree (layer 0 in
full, layer 1's attention), so the split's greedy output equals the INT4-only engine's exactly in fp32
reference mode, on GQA (glm4_moe) and on the MLA latent with the DSA indexer (glm_moe_dsa)."""

from __future__ import annotations

import pytest

from kvq.runtime.engine import Engine
from kvq.runtime.pd_engine import generate_split
from kvq.runtime.sampling import SamplingParams
from tests.runtime.conftest import compress
from tests.runtime.test_kv_transfer import engine, prompts

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["glm4_moe", "glm_moe_dsa"])
def test_fp8_prefill_int4_decode_equals_the_int4_engine(tiny_checkpoint, tmp_path, arch: str) -> None:
    fp8 = tiny_checkpoint(arch, "fp8-block", num_layers=2)
    int4 = compress(fp8, tmp_path / "int4", "w4a16-experts", 128)
    expected = [o.token_ids for o in engine(int4, Engine).generate(prompts(), GREEDY)]
    prefill, decode = engine(fp8), engine(int4, kv_integrity="tags")
    outputs = generate_split(prefill, decode, prompts(), GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert decode.stats.integrity_aborts == 0 and decode.stats.num_steps == GREEDY.max_tokens
    fp8_only = [o.token_ids for o in engine(fp8, Engine).generate(prompts(), GREEDY)]
    assert fp8_only != expected  # the INT4 experts do change the answer: the test is not vacuous
