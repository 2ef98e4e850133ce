from solution import Inventory


def test_add():
    inventory = Inventory()
    inventory.add("apple", 3)
    assert inventory.count("apple") == 3
