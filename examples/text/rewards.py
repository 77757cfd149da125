"""The text example's reward, written as a user writes one: say the prompt's last digit, then stop.

timeshare binds parameters by name: `completion` is the completion's text (without its EOS),
`label` the row's `answer` column, `finish_reason` "stop" when the completion ended at EOS.
Half for saying the digit first, half for stopping right after it; nothing for a completion cut
at the length limit. The extras are averaged into each step's figures (TensorBoard: reward/...).
"""


def compute_score(completion: str, label: str, finish_reason: str) -> dict[str, float]:
    said = completion.split()
    right_digit = bool(said) and said[0] == label
    stopped = finish_reason == "stop" and said == [label]
    if finish_reason != "stop":
        return {"score": 0.0, "right_digit": float(right_digit), "stopped": 0.0}
    score = 0.5 * right_digit + 0.5 * stopped
    return {"score": score, "right_digit": float(right_digit), "stopped": float(stopped)}
