"""The on-policy engine PPO and RLOO share. Built in issue #4; nothing here yet."""
