def parse_config(text):
    config = {}
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if "=" not in stripped:
            raise ValueError(f"not a key = value line: {line!r}")
        key, value = stripped.split("=", 1)
        config[key.strip()] = value.strip()
    return config
