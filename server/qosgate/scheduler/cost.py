"""What a request costs in the fair share between tenants (see docs/configuration.md, "Cost model").

LLM requests cost weighted tokens, as in VTC: prompt + w x output, w = the scheduler's
`output_token_weight`; at admission the output is max_tokens, at finish what the engine
generated. Requests without token counts cost the model's `cost_unit`.
"""

from __future__ import annotations

from qosgate.config import CostUnit


def token_cost(prompt_tokens: int, output_tokens: int, output_weight: float) -> float:
    return prompt_tokens + output_weight * output_tokens


def unit_cost(unit: CostUnit, *, texts: int, size: int) -> float:
    """The cost of a request of `texts` texts (or batch rows) and `size` bytes."""
    if unit == "text":
        return float(max(1, texts))
    if unit == "byte":
        return float(max(1, size))
    return 1.0
