def rle_encode(text):
    raise NotImplementedError


def rle_decode(text):
    raise NotImplementedError
