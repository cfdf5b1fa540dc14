"""What every part of prime-hpc stands on, importing nothing of its own: errors, addresses
and ports (`net`), device and backend choice (`device`), and the environment a job gives
its processes (`jobenv`)."""
