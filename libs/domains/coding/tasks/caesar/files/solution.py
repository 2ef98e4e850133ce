def encode(text, shift):
    raise NotImplementedError


def decode(text, shift):
    raise NotImplementedError
