def is_palindrome(text):
    raise NotImplementedError
