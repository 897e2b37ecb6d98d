"""Starting, watching and stopping replica processes."""
