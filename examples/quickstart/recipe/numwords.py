"""Shared helper: English words for integers 0..9999 (no "and", hyphenated tens)."""

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
        "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
        "seventeen", "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]

MAX_N = 9999


def _below_100(n: int) -> str:
    if n < 20:
        return ONES[n]
    t, o = divmod(n, 10)
    return TENS[t] if o == 0 else f"{TENS[t]}-{ONES[o]}"


def to_words(n: int) -> str:
    """347 -> 'three hundred forty-seven', 2005 -> 'two thousand five'."""
    if not 0 <= n <= MAX_N:
        raise ValueError(n)
    if n == 0:
        return "zero"
    parts = []
    th, rest = divmod(n, 1000)
    if th:
        parts.append(f"{ONES[th]} thousand")
    h, rest = divmod(rest, 100)
    if h:
        parts.append(f"{ONES[h]} hundred")
    if rest:
        parts.append(_below_100(rest))
    return " ".join(parts)
