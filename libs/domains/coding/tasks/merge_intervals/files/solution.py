def merge_intervals(intervals):
    raise NotImplementedError
