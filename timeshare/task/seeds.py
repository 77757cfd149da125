"""Seeds that follow from several integers: the prompts and sampling seeds of a step are a
function of (seed, rank, step) alone, so that the data position is a step number."""


def mix(*parts: int) -> int:
    """One 63-bit seed from several integers (distinct tuples give unrelated streams)."""
    value = 0x9E3779B97F4A7C15
    for part in parts:
        value = (value ^ (part + 0x632BE59BD9B4E019 + (value << 6) + (value >> 2))) & (2**63 - 1)
    return value
