"""What a run shows and leaves: phases, clocks, timelines, TensorBoard, memory, report."""
