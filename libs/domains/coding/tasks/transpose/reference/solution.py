def transpose(matrix):
    if not matrix:
        return []
    return [[row[c] for row in matrix] for c in range(len(matrix[0]))]
