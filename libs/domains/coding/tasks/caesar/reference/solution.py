def _shift(char, shift):
    for first in ("a", "A"):
        base = ord(first)
        if base <= ord(char) < base + 26:
            return chr(base + (ord(char) - base + shift) % 26)
    return char


def encode(text, shift):
    return "".join(_shift(c, shift) for c in text)


def decode(text, shift):
    return encode(text, -shift)
