def to_roman(n):
    raise NotImplementedError
