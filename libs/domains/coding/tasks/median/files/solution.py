def median(numbers):
    numbers.sort()
    return numbers[len(numbers) // 2]
