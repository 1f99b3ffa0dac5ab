from steadylm.doctor.cli import main

main()
