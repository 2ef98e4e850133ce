def rle_encode(text):
    out = []
    i = 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(f"{j - i}{text[i]}")
        i = j
    return "".join(out)


def rle_decode(text):
    out = []
    count = ""
    for char in text:
        if char.isdigit():
            count += char
        else:
            out.append(char * int(count))
            count = ""
    return "".join(out)
