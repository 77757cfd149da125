"""How a minibatch's per-token losses make its loss, as `[engine.grpo] loss_aggregation` names
it: the mean over its real tokens (verl's default), or the mean over sequences of each one's
token mean. No torch here: the settings (engines/spec.py) read it; grpo_math.py computes it."""

from typing import Literal

LossAggregation = Literal["token-mean", "seq-mean-token-mean"]
