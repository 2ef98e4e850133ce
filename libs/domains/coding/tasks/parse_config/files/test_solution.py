from solution import parse_config


def test_one():
    assert parse_config("a = 1") == {"a": "1"}
