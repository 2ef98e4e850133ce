class Stack:
    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        raise NotImplementedError

    def peek(self):
        raise NotImplementedError

    def size(self):
        raise NotImplementedError

    def is_empty(self):
        raise NotImplementedError
