"""SGLang stops a request at its own stop tokens and at no others.

A timeshare request carries the job's one stop set (the tokenizer's EOS, generation_config's,
the job's own: base.py `SamplingParams`), and every engine must stop where every other would.
SGLang 0.5.23 stops a request at the first token of its `stop_token_ids`, and also at the
model's EOS (config.json's `eos_token_id` with generation_config.json's: model_config.py
`_get_hf_eos_token_id`) and, where it has a tokenizer (a multimodal model), at the tokenizer's
EOS and additional stop tokens (schedule_batch.py `Req._check_token_based_finish`). Its only
switch, `ignore_eos`, turns off every token stop, the request's own included. `REQUEST_STOPS`
makes the check read the request's `stop_token_ids` alone; everything else (how the match is
recorded, `finished_len` through the matched token, which SGLang keeps in `output_ids`) is
SGLang's. It is applied in SGLang's scheduler (plugin.py).

Switched off (TS_PATCHES_OFF), SGLang stops at the model's EOS too; the rollout then refuses
the completion that ended at a token outside its request's set (engine.py `_finish_reason`).
"""

from __future__ import annotations

from typing import Any

from timeshare.engines.patches import Patch

TARGET = "sglang.srt.managers.schedule_batch:Req._check_token_based_finish"


def stop_at_request_stops_only() -> None:
    from sglang.srt.managers.schedule_batch import (  # noqa: PLC0415
        FINISH_MATCHED_TOKEN,
        Req,
    )

    def _check_token_based_finish(self: Any, new_accepted_tokens: list[int]) -> bool:
        stops = self.sampling_params.stop_token_ids
        if self.sampling_params.ignore_eos or not stops:
            return False
        for index, token_id in enumerate(new_accepted_tokens):
            if token_id in stops:
                self.finished_reason = FINISH_MATCHED_TOKEN(matched=token_id)
                # through the matched token (as SGLang's own check): the completion keeps it
                self.finished_len = len(self.output_ids) - len(new_accepted_tokens) + index + 1
                return True
        return False

    Req._check_token_based_finish = _check_token_based_finish


REQUEST_STOPS = Patch(
    name="sglang.request_stops",
    source_of=TARGET,
    known=frozenset({"97f9d27051d355bf"}),  # sglang 0.5.23
    apply=stop_at_request_stops_only,
    why="SGLang adds the model's EOS to a request's stop tokens (ignore_eos drops both)",
)
