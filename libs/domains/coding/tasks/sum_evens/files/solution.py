def sum_evens(numbers):
    total = 0
    for i in range(1, len(numbers)):
        if numbers[i] % 2 == 0:
            total += numbers[i]
    return total
