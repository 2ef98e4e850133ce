def parse_config(text):
    raise NotImplementedError
