def from_roman(text):
    raise NotImplementedError
