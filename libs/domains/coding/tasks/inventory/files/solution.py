class Inventory:
    def __init__(self):
        self._stock = {}

    def add(self, name, count):
        raise NotImplementedError

    def remove(self, name, count):
        raise NotImplementedError

    def count(self, name):
        raise NotImplementedError

    def items(self):
        raise NotImplementedError
