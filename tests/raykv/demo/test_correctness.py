"""The demo's correctness check: float noise passes, a real mismatch fails."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from raykv.demo.correctness import bit_exact, compare_outputs, logprob_tolerance
from raykv.demo.messages import Completion
from raykv.demo.run import passed


def _out(
    token_ids: list[int], top_logprobs: list[tuple[int, float]], top2: list[tuple[float, float]] | None = None
) -> Completion:
    """A completion with the fields the comparison reads."""
    return Completion(
        prompt_tokens=0, cached_tokens=0, ttft_ms=0.0, token_ids=token_ids, top_logprobs=top_logprobs, top2=top2
    )


# Two requests as the engine reports them: output token ids and the first token's top-5.
REFERENCE = [
    _out([17], [(17, -0.41), (902, -2.3), (5, -3.9), (44, -5.25), (1201, -7.62)]),
    _out([88], [(88, -1.02), (3, -1.9), (650, -4.4), (71, -6.1), (9, -8.75)]),
]


def test_tolerance_follows_the_dtype() -> None:
    assert logprob_tolerance("bfloat16", -0.5) == pytest.approx(2 * 2**-7)
    assert logprob_tolerance("bfloat16", -8.0) == pytest.approx(2 * 2**-7 * 8)
    assert logprob_tolerance("float32", -8.0) < logprob_tolerance("float16", -8.0) < logprob_tolerance("bfloat16", -8.0)
    with pytest.raises(ValueError, match="dtype"):
        logprob_tolerance("int8", -1.0)


def test_one_rounding_step_passes_and_is_reported() -> None:
    other = copy.deepcopy(REFERENCE)
    other[1].top_logprobs[0] = (88, -1.02 - 2**-7)  # one bf16 step: what a different split gives
    check = compare_outputs(REFERENCE, other, "bfloat16")
    assert check.ok
    assert check.max_diff == pytest.approx(2**-7)
    assert "largest logprob difference 0.0078" in check.line() and ": yes\n" in check.line()


def test_a_logprob_beyond_the_tolerance_fails() -> None:
    other = copy.deepcopy(REFERENCE)
    tok, lp = other[0].top_logprobs[3]
    other[0].top_logprobs[3] = (tok, lp + 1.5 * logprob_tolerance("bfloat16", lp))
    check = compare_outputs(REFERENCE, other, "bfloat16")
    assert not check.ok
    assert check.logprob_mismatches == [0] and check.token_mismatches == []
    assert ": NO;" in check.line().splitlines()[0]


def test_a_changed_token_fails() -> None:
    other = copy.deepcopy(REFERENCE)
    other[1] = dataclasses.replace(other[1], token_ids=[89])
    check = compare_outputs(REFERENCE, other, "bfloat16")
    assert not check.ok and check.token_mismatches == [1]


def test_the_demo_exits_nonzero_on_a_mismatch_or_an_inexact_probe() -> None:
    good = {"outputs_match": True, "exact_probe": {"bit_exact": True}}
    assert passed(good)
    assert not passed({**good, "outputs_match": False})
    assert not passed({**good, "exact_probe": {"bit_exact": False}})


def test_bit_exact_means_every_bit() -> None:
    assert bit_exact(REFERENCE[0], copy.deepcopy(REFERENCE[0]))
    nudged = copy.deepcopy(REFERENCE[0])
    nudged.top_logprobs[4] = (1201, -7.62 + 1e-12)
    assert not bit_exact(REFERENCE[0], nudged)


def test_a_token_may_differ_only_after_a_near_tie() -> None:
    ref = _out([5, 6, 7], [(5, -0.5), (9, -1.5)], top2=[(-0.5, -1.5), (-0.9, -0.91)])
    # position 1 is a near-tie (0.01 apart): the other run may continue differently from there
    other = _out([5, 8, 3], [(5, -0.5), (9, -1.5)])
    assert compare_outputs([ref], [other], "bfloat16").ok
    # position 0 was decisive (1.0 apart): a different token there is a real mismatch
    other = _out([4, 6, 7], [(5, -0.5), (9, -1.5)])
    assert compare_outputs([ref], [other], "bfloat16").token_mismatches == [0]
    # a lone candidate is no tie
    lone = dataclasses.replace(ref, top2=[(-0.5, float("-inf")), (-0.9, float("-inf"))])
    other = _out([5, 8, 3], [(5, -0.5), (9, -1.5)])
    assert not compare_outputs([lone], [other], "bfloat16").ok
