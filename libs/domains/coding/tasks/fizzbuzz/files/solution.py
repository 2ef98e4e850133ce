def fizzbuzz(n):
    """Return the FizzBuzz word for n (n >= 1)."""
    raise NotImplementedError
