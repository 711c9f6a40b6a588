# ---- site setup lines (cluster.setup; trusted shell, not quoted) ----
{{setup_lines}}
