"""The agent: the loop that keeps the datapath equal to the desired state, and its run state."""
