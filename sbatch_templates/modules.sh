# ---- environment modules (cluster.modules) ----
# A non-login batch shell may lack the `module` function: source the site's init if needed.
if ! type module >/dev/null 2>&1; then
    for init in /etc/profile.d/lmod.sh /etc/profile.d/z00_lmod.sh /etc/profile.d/modules.sh; do
        if [ -f "$init" ]; then . "$init"; break; fi
    done
fi
{{module_loads}}
