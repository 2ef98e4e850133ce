def convert(value, unit):
    raise NotImplementedError
