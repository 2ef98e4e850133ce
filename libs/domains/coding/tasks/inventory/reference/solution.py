class Inventory:
    def __init__(self):
        self._stock = {}

    @staticmethod
    def _check(count):
        if not isinstance(count, int) or count <= 0:
            raise ValueError("count must be a positive integer")

    def add(self, name, count):
        self._check(count)
        self._stock[name] = self._stock.get(name, 0) + count

    def remove(self, name, count):
        self._check(count)
        if name not in self._stock:
            raise KeyError(name)
        if count > self._stock[name]:
            raise ValueError("not enough stock")
        self._stock[name] -= count
        if self._stock[name] == 0:
            del self._stock[name]

    def count(self, name):
        return self._stock.get(name, 0)

    def items(self):
        return [[name, count] for name, count in sorted(self._stock.items())]
