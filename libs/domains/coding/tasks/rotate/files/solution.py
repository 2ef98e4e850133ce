def rotate(items, k):
    raise NotImplementedError
