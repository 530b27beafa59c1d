"""What edged asks of the machine it runs on: the memory budget's probes (jtop, NVML,
/proc/meminfo), the heap's settings, and systemd's notify and socket-activation protocols."""
