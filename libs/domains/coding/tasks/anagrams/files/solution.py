def group_anagrams(words):
    raise NotImplementedError
