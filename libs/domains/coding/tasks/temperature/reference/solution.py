def convert(value, unit):
    if unit == "C":
        return round(value * 9 / 5 + 32, 2)
    if unit == "F":
        return round((value - 32) * 5 / 9, 2)
    raise ValueError(f"unknown unit {unit!r}")
