
Bcurrent_keyJ 9DD>ά»b:SΏa@Z/5ArDBh?3ΔιA¨@_@_CFBvΌkΕΕ?ΔFAΐ΄Ζ­ΒαB?ΔΕ—<ΥC·Ή¨½‡4CDYΉX>XΔΎΑΨ>Y;·DΛ°0D`Α©>uΊj6Ώ=‘Β—EΑ7?dFΘ@6ΎΖΒ—Ί——yCΒ'v>hΔlA―Β~BL,¶ΔΉ78Δ4Ε[DΌvΒ>Α