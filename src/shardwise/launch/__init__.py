"""Starting jobs on this machine: the job runner and the parameter-server supervisor."""
