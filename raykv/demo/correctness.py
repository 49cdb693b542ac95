"""Is an output served with raykv the output the engine would have given without it?

Two runs of one prompt split it differently between cached and computed
tokens (a prefix hit computes only the suffix), so their floating-point sums
run in another order: the logits may differ by a rounding step of the model's
dtype while the KV bytes are right. Wrong KV (another model's, another
prompt's) changes tokens and moves logprobs by far more. So:

- token ids must be equal, except from a position where the reference's
  top two logprobs were within twice the tolerance of each other: there
  float noise may pick the runner-up, and greedy decoding then goes its own
  way (both runs are right; positions after it are not compared);
- the top-k logprobs of the first output token, compared rank by rank, must
  agree within ``LOGPROB_ULPS`` rounding steps of the dtype at the logprob's
  magnitude: ``|a - b| <= 2 * eps(dtype) * max(1, |a|)`` (bf16: eps = 2^-7,
  so 0.016 at |logprob| <= 1 and 0.12 at -7.6, a uniform guess over 2048
  tokens). vLLM computes logits in the model dtype, then logprobs in float32;
- one probe must be bit-exact: a prefix loaded from raykv against the same
  prefix from the engine's own prefix cache, at the same split (same cached
  token count): then the computation is the same and so must be every bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from raykv.core.wire import JsonValue, Report
from raykv.demo.messages import Completion

#: Machine epsilon (one rounding step relative to the value) per model dtype.
DTYPE_EPS = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-23}
LOGPROB_ULPS = 2


def logprob_tolerance(dtype: str, reference: float) -> float:
    """Largest difference allowed from ``reference`` (a logprob) for outputs of a ``dtype`` model."""
    if dtype not in DTYPE_EPS:
        raise ValueError(f"dtype: {dtype!r} not one of {', '.join(DTYPE_EPS)}")
    return LOGPROB_ULPS * DTYPE_EPS[dtype] * max(1.0, abs(reference))


def tolerance_rule(dtype: str) -> str:
    return f"|diff| <= {LOGPROB_ULPS} x eps({dtype}) x max(1, |logprob|), eps = {DTYPE_EPS[dtype]:.3g}"


@dataclass
class Comparison:
    """Request-by-request comparison of two runs' outputs."""

    dtype: str
    requests: int = 0
    token_mismatches: list[int] = field(default_factory=list)  # request indices
    logprob_mismatches: list[int] = field(default_factory=list)
    max_diff: float = 0.0  # largest |logprob difference| seen
    tolerance_at_max: float = 0.0  # the tolerance where that difference was

    @property
    def ok(self) -> bool:
        return not self.token_mismatches and not self.logprob_mismatches

    def line(self) -> str:
        """Two lines a person reads: the verdict, then the largest difference and the tolerance."""
        verdict = "yes" if self.ok else "NO"
        bad = ""
        if not self.ok:
            bad = (
                f"; token ids differ in requests {self.token_mismatches}, "
                f"logprobs beyond tolerance in requests {self.logprob_mismatches}"
            )
        return (
            f"outputs equal (token ids; top-5 logprobs within tolerance), {self.requests} requests: {verdict}{bad}\n"
            f"  largest logprob difference {self.max_diff:.2g}, tolerance there {self.tolerance_at_max:.2g} "
            f"({tolerance_rule(self.dtype)})"
        )

    def to_dict(self) -> Report:
        return {
            "ok": self.ok,
            "requests": self.requests,
            "token_mismatches": list[JsonValue](self.token_mismatches),
            "logprob_mismatches": list[JsonValue](self.logprob_mismatches),
            "max_logprob_diff": self.max_diff,
            "tolerance_at_max": self.tolerance_at_max,
            "tolerance_rule": tolerance_rule(self.dtype),
        }


def compare_outputs(reference: Sequence[Completion], other: Sequence[Completion], dtype: str) -> Comparison:
    """Compare completions (``token_ids``, and ``top_logprobs`` as ``[(token, logprob), ...]``) request by request."""
    if len(reference) != len(other):
        raise ValueError(f"other: {len(other)} outputs, reference has {len(reference)}")
    result = Comparison(dtype=dtype, requests=len(reference))
    worst_ratio = -1.0
    for i, (ref, out) in enumerate(zip(reference, other)):
        if not _same_tokens(ref, out, dtype):
            result.token_mismatches.append(i)
        ref_lp = sorted((lp for _, lp in ref.top_logprobs), reverse=True)
        out_lp = sorted((lp for _, lp in out.top_logprobs), reverse=True)
        if len(ref_lp) != len(out_lp):
            result.logprob_mismatches.append(i)
            continue
        beyond = False
        for a, b in zip(ref_lp, out_lp):
            diff, tol = abs(a - b), logprob_tolerance(dtype, a)
            if diff / tol > worst_ratio:
                worst_ratio, result.max_diff, result.tolerance_at_max = diff / tol, diff, tol
            beyond = beyond or diff > tol
        if beyond:
            result.logprob_mismatches.append(i)
    return result


def _same_tokens(ref: Completion, out: Completion, dtype: str) -> bool:
    """Equal token ids up to the first near-tie of the reference (see the module doc)."""
    a, b = list(ref.token_ids), list(out.token_ids)
    if len(a) != len(b):
        return False
    top2 = ref.top2 or []
    for pos, (x, y) in enumerate(zip(a, b)):
        if pos < len(top2):
            first, second = top2[pos]
            if second > float("-inf") and first - second <= 2 * logprob_tolerance(dtype, second):
                return True  # a near-tie: from here on either continuation is right
        if x != y:
            return False
    return True


def bit_exact(a: Completion, b: Completion) -> bool:
    """Same token ids and the same top-k tokens with the same logprobs, to the bit."""
    return list(a.token_ids) == list(b.token_ids) and sorted(map(tuple, a.top_logprobs)) == sorted(
        map(tuple, b.top_logprobs)
    )
