from solution import group_anagrams


def test_pair():
    assert group_anagrams(["ab", "ba"]) == [["ab", "ba"]]
