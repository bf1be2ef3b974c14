"""RLOO: k samples per prompt, leave-one-out advantages. Built in issue #5; nothing here yet."""
